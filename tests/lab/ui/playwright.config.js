// Galata's Playwright settings, run against Debian's chromium (no browser download), video off.
const baseConfig = require('@jupyterlab/galata/lib/playwright-config');

const port = process.env.MWB_UI_PORT || '8899';
process.env.TARGET_URL = process.env.TARGET_URL || `http://127.0.0.1:${port}`;

module.exports = {
  ...baseConfig,
  timeout: 90000,
  retries: 0,
  workers: 1,
  reporter: [['list']],
  outputDir: process.env.MWB_UI_RESULTS || 'test-results',
  use: {
    ...baseConfig.use,
    baseURL: process.env.TARGET_URL,
    video: 'off',
    trace: 'off',
    screenshot: 'only-on-failure',
    browserName: 'chromium',
    launchOptions: {
      executablePath: process.env.CHROMIUM_PATH || '/usr/bin/chromium',
      args: [
        '--headless=new',
        '--no-sandbox',
        '--disable-gpu',
        '--disable-dev-shm-usage',
        '--disable-quic',
        '--no-first-run',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync'
      ]
    }
  },
  projects: [{ name: 'chromium', use: {} }],
  webServer: {
    command: 'jupyter lab --config jupyter_server_test_config.py',
    url: `${process.env.TARGET_URL}/lab`,
    timeout: 120000,
    reuseExistingServer: false,
    stdout: 'pipe',
    stderr: 'pipe'
  }
};
