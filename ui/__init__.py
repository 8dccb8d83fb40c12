"""faultlens.ui"""
