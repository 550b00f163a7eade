"""`python -m specdistill.decode.validate`."""

from specdistill.decode.validate.stage import main

if __name__ == "__main__":
    main()
