"""faultlens.diagnosis"""
