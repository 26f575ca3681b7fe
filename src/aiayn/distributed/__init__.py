"""Where processes, devices and the optimizer engine are decided; the model never imports this."""
