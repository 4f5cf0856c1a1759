# shutil copies a tree, moves a file and removes one, as a build step does.
# expect-stdout: "['build/src/app.py', 'build/src/util.py']\n"
# expect-file: build/src/app.py
import os
import shutil

shutil.copytree("src", "build/src")
shutil.move("build/src/old.py", "build/src/util.py")
os.remove("src/old.py")
print(sorted(os.path.join(r, f) for r, _, fs in os.walk("build") for f in fs))
