"""The dashboard's screenshots under docs/dashboard (``python scripts/dashboard_screenshots.py``;
Debian's chromium and chromium-driver, see scripts/browser.sh): a two-site deployment with
elastic serving replicas, trained, one worker killed and recovered, under load (a serving
replica added). About two minutes on two cores."""

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

ROOT = Path(__file__).resolve().parents[1]
home = Path(tempfile.mkdtemp(prefix="dmsc-shots-"))
env = {**os.environ, "DMSC_HOME": str(home)}


def dmsc(*a):
    r = subprocess.run(
        [str(ROOT / ".venv/bin/dmsc"), *a], env=env, capture_output=True, text=True, cwd=home
    )
    if r.returncode:
        sys.exit(f"dmsc {a}: {r.stderr}")
    return r.stdout


dmsc(
    "plan",
    "--cluster",
    str(ROOT / "examples/clusters/two-sites-cpu.yaml"),
    "--model",
    "gpt-mini",
    "--global-batch",
    "16",
    "--micro-batch",
    "4",
    "--tp",
    "1",
    "--pp",
    "2",
    "--dp",
    "1",
    "--out",
    "plan.json",
)
port = 18091
dmsc(
    "up",
    "--plan",
    "plan.json",
    "--gateway",
    f"127.0.0.1:{port}",
    "--tenant-requests",
    "16",
    "--autoscale",
    "infer:min=1,max=2,target=1,cooldown=20,window=3",
)
base = f"http://127.0.0.1:{port}"
try:
    key = re.findall(
        r"dmsc_[A-Za-z0-9_-]+",
        dmsc(
            "token",
            "create",
            "--tenant",
            "ops",
            "--scopes",
            "read,infer",
            "--rate",
            "1000",
            "--burst",
            "1000",
        ),
    )[-1]
    dmsc("train", "--steps", "60")
    dmsc("chaos", "--kill-worker", "stage=1", "--watch", "60")
    dmsc("train", "--steps", "20")
    stop = time.monotonic() + 45

    def client():
        with httpx.Client(timeout=120) as c:
            while time.monotonic() < stop:
                c.post(
                    f"{base}/v1/infer",
                    json={"prompt": "def ", "tokens": 24},
                    headers={"Authorization": f"Bearer {key}"},
                )

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    opts = webdriver.ChromeOptions()
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        "--hide-scrollbars",
    ):
        opts.add_argument(a)
    opts.binary_location = "/usr/bin/chromium"
    d = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    out = ROOT / "docs/dashboard"
    d.get(base + "/ui")
    time.sleep(1)
    d.save_screenshot(str(out / "login.png"))
    d.find_element(By.ID, "key").send_keys(key)
    d.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:  # wait for the serving replica
        s = httpx.get(f"{base}/ui/api/state", headers={"Authorization": f"Bearer {key}"}).json()
        if s["serving"]:
            break
        time.sleep(1)
    time.sleep(3)
    for page, name in (("", "overview"), ("/tasks", "tasks"), ("/charts", "charts")):
        d.set_window_size(1400, 1000)
        d.get(base + "/ui" + page)
        time.sleep(3)
        h = d.execute_script("return document.documentElement.scrollHeight")
        d.set_window_size(1400, max(700, h + 20))
        time.sleep(1.5)
        d.save_screenshot(str(out / f"{name}.png"))
    d.quit()
    for t in threads:
        t.join()
finally:
    dmsc("down")
