"""The training run: the loop (loop.py), what it drives (runtime.py), the lag bound (buffer.py) and what
it records (records.py)."""
