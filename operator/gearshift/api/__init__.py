"""gearshift.api"""
