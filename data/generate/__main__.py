"""`python -m specdistill.data.generate`."""

from specdistill.data.generate.stage import main

if __name__ == "__main__":
    main()
