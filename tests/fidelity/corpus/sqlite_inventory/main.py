# An sqlite database made, filled and queried in the current directory.
# expect-stdout: "bolts 300\nnuts 120\n"
# expect-file: inventory.db
import sqlite3

db = sqlite3.connect("inventory.db")
db.execute("create table stock (item text primary key, count integer)")
db.executemany("insert into stock values (?, ?)", [("nuts", 100), ("bolts", 300)])
db.execute("update stock set count = count + 20 where item = 'nuts'")
db.commit()
for item, count in db.execute("select item, count from stock order by item"):
    print(item, count)
db.close()
