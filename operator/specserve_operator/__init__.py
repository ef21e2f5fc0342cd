"""specserve operator"""
