NAME = "capture"
