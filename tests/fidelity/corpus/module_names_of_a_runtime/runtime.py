NAME = "runtime"
