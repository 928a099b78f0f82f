"""What a plan does, for people: text tables (paper Table 3 style) and their legend, the
event-driven simulator of one iteration (an independent check of Eq. 5), Gantt charts.

Imports eth.spec, eth.profiles, eth.cost, eth.layout.
"""
