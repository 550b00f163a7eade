"""Online adaptation: the drafter updated while serving, from what verification already computed."""
