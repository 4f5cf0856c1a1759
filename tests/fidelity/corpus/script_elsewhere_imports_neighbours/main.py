# run: tools/report.py
