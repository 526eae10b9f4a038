"""gearshift.router"""
