"""Start the scdviz app from a checkout (a Gradio Space runs this file); the app is scdviz.app.webapp.

    pip install -r requirements.txt && python app.py
"""

from scdviz.app.webapp import main

if __name__ == "__main__":
    main()
