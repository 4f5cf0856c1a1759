# __del__ of objects still alive when the interpreter ends runs, and atexit handlers before it.
# expect-stdout: "atexit\nfinalized resource\n"
import atexit


class Resource:
    def __del__(self):
        print("finalized resource")


held = Resource()
atexit.register(print, "atexit")
