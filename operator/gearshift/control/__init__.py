"""gearshift.control"""
