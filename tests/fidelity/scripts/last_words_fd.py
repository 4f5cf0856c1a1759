import os

os.write(1, b"bye\n")
os._exit(3)
