X = "mine"
