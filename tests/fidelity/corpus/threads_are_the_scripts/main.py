# threading.enumerate() and sys._current_frames(): the main thread, then the script's own.
# expect-stdout: "['MainThread']\n['MainThread', 'helper']\n"
import sys
import threading

print([t.name for t in threading.enumerate()])
release = threading.Event()
helper = threading.Thread(target=release.wait, name="helper")
helper.start()
print(sorted(t.name for t in threading.enumerate()))
print("frames", len(sys._current_frames()), "active", threading.active_count())
release.set()
helper.join()
