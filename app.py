"""Start the scdviz app from a checkout (a Gradio Space runs this file); the app is scdviz.app.webapp.

    pip install -r requirements.txt && python app.py
"""

try:  # a ZeroGPU Space: its package first, before anything could initialise CUDA
    import spaces  # noqa: F401
except ImportError:  # anywhere else
    pass

from scdviz.app.webapp import main  # noqa: E402

if __name__ == "__main__":
    main()
