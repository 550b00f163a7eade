"""llama.cpp's `llama-server` as a managed engine: built once into the cache (`build.py`),
started and asked for completions by token id (`server.py`), its counters turned into
acceptance, tau, tokens/s and speedup (`measure.py`).

Nothing here imports llama.cpp: the server is a subprocess spoken to over loopback HTTP.
"""
