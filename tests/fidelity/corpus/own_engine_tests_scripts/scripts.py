WHO = "project scripts"
