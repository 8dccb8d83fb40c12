"""faultlens.datasets"""
