# Archives made from the project's files, listed and unpacked again.
# expect-stdout: "tar: ['docs/a.txt', 'docs/b.txt']\nzip: ['docs/a.txt', 'docs/b.txt']\n"
# expect-file: unpacked/docs/b.txt
import tarfile
import zipfile

with tarfile.open("docs.tar", "w") as tar:
    tar.add("docs")
with zipfile.ZipFile("docs.zip", "w") as zf:
    for name in ("docs/a.txt", "docs/b.txt"):
        zf.write(name)
with tarfile.open("docs.tar") as tar:
    print("tar:", sorted(m.name for m in tar.getmembers() if m.isfile()))
    tar.extractall("unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
with zipfile.ZipFile("docs.zip") as zf:
    print("zip:", sorted(zf.namelist()))
