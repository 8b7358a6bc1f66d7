"""Dataflow graph, execution plans and their JSON form."""
