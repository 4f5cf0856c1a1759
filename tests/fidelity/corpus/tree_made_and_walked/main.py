# Directories made, files written with modes of the script's choice, the tree walked.
# expect-stdout: "out/a/b/leaf.txt\n"
# expect-file: out/a/b/leaf.txt
import os

os.makedirs("out/a/b", exist_ok=True)
for path, mode in (("out/a/b/leaf.txt", 0o640), ("out/top.txt", 0o600)):
    with open(path, "w") as f:
        f.write(path + "\n")
    os.chmod(path, mode)
os.chmod("out/a", 0o750)
for root, _dirs, files in sorted(os.walk("out")):
    for name in sorted(files):
        print(os.path.join(root, name))
