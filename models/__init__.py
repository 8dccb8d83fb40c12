"""faultlens.models"""
