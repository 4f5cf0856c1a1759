NAME = "wire"
