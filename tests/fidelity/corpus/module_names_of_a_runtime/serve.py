NAME = "serve"
