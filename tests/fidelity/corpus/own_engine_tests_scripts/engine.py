WHO = "project engine"
