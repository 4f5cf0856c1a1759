# run: lib/job.py
