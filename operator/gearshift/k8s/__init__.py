"""gearshift.k8s"""
