"""`python -m specdistill.distill.train`."""

from specdistill.distill.train.stage import main

if __name__ == "__main__":
    main()
