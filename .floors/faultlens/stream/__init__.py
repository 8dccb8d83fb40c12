"""Transport and storage: topics, message schemas, Kafka clients, the lake.

Imports no other faultlens part.
"""
