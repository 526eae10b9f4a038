"""gearshift.probe"""
