# Who the script runs as: a passwd entry for its uid, getpass, HOME, USER as given.
# expect-stdout: "passwd entry: True\n"
import getpass
import os
import pwd

entry = pwd.getpwuid(os.getuid())
print("passwd entry:", entry.pw_name == getpass.getuser() or "USER" in os.environ or "LOGNAME" in os.environ)
print("user:", getpass.getuser(), "uid:", os.getuid(), "gid:", os.getgid())
print("HOME:", os.environ.get("HOME"), "USER:", os.environ.get("USER"))
print("expanduser:", os.path.expanduser("~"))
