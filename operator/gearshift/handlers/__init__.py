"""gearshift.handlers"""
