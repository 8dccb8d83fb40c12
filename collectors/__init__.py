"""faultlens.collectors"""
