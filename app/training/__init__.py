"""The training run: the loop (loop.py), what it drives (setup.py, built once; resume.py, where it starts), the
lag bound (buffer.py, lag.py) and what it records (records.py)."""
