# The host's name and the working directory are what python sees.
# expect-stdout: "same name: True\n"
import os
import platform
import socket

print("same name:", socket.gethostname() == platform.node() == os.uname().nodename)
print("name:", socket.gethostname())
print("cwd:", os.getcwd())
