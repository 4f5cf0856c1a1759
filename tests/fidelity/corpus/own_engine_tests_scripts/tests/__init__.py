WHO = "project tests"
