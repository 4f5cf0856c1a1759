# A config file beside the script, found through __file__, while the cwd is elsewhere.
# cwd: work
# expect-stdout: "mode = fast\n"
# expect-file: work/result.txt
import json
import os

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "config.json")) as f:
    config = json.load(f)
print("mode =", config["mode"])
with open("result.txt", "w") as f:
    f.write(config["mode"] + "\n")
