# Text in several encodings written and read back; the locale's view of things.
# expect-stdout: "utf-16: 22 bytes True\n"
import locale
import sys

text = "naïve Σ 日本"
for encoding in ("utf-8", "utf-16", "latin-1"):
    try:
        data = text.encode(encoding)
    except UnicodeEncodeError as exc:
        print(f"{encoding}: {exc.reason}")
        continue
    with open(f"t.{encoding}", "wb") as f:
        f.write(data)
    print(f"{encoding}: {len(data)} bytes", open(f"t.{encoding}", encoding=encoding).read() == text)
print(sys.getfilesystemencoding(), locale.getpreferredencoding(False), sys.stdin.encoding)
