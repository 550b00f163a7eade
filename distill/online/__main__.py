"""`python -m specdistill.distill.online`."""

from specdistill.distill.online.stage import main

if __name__ == "__main__":
    main()
