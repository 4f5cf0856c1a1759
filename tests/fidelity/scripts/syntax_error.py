"""A script that does not compile: Python's SyntaxError report, exit status 1."""
print("never runs")
def broken(:
    pass
