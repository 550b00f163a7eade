"""`python -m specdistill.distill.pipeline`."""

from specdistill.distill.pipeline.stage import main

if __name__ == "__main__":
    main()
