"""gearshift.planner"""
