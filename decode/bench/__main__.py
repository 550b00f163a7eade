"""`python -m specdistill.decode.bench`."""

from specdistill.decode.bench.stage import main

if __name__ == "__main__":
    main()
