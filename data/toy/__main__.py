"""`python -m specdistill.data.toy`."""

from specdistill.data.toy.world import main

if __name__ == "__main__":
    main()
