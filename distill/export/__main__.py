"""`python -m specdistill.distill.export`."""

from specdistill.distill.export.stage import main

if __name__ == "__main__":
    main()
