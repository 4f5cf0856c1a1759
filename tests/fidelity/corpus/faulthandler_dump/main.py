# faulthandler's dump: one thread and the script's frames (thread ids masked).
# expect-stdout: 'File "'
import faulthandler
import re
import tempfile


def where():
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        print(re.sub(r"0x[0-9a-f]+", "0x…", f.read()), end="")


where()
