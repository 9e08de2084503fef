/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.io.File;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.regex.Pattern;

import org.junit.Assume;
import org.junit.Test;

/**
 * Runs {@link NativeBridgeJniScenario} against the real native library in a child JVM started
 * with {@code -Xcheck:jni}, and fails on any JNI complaint HotSpot prints.
 *
 * <p>Skipped (visibly, with the command that builds the library) when the library is neither
 * bundled in the test classpath ({@code scripts/build-native.sh} puts it in
 * {@code plugin/target/native}, which Maven copies into the classes) nor on
 * {@code java.library.path}. {@code -Drdma.jni.required=true} (what {@code scripts/jni-test.sh}
 * passes) turns the skip into a failure, so CI cannot pass without the test having run.
 *
 * <p>The child's stdout and stderr are kept in {@code target/spark-<line>/jni-check/}
 * ({@code -Drdma.jni.outDir} overrides). HotSpot
 * writes most {@code -Xcheck:jni} warnings to stdout (its "tty"), so both streams are searched.
 */
public class NativeBridgeJniTest {
  /** Bound on the child JVM; the scenario itself bounds every wait to 60 s. */
  private static final long CHILD_TIMEOUT_S = 300;

  /**
   * Lines HotSpot prints under {@code -Xcheck:jni} (jniCheck.cpp / jniCheck.hpp in OpenJDK 17):
   * misuse reports ("WARNING in native method: ...", "FATAL ERROR in native method: ..."),
   * leaked local references ("WARNING: JNI local refs: N, exceeds capacity: M"), and calls
   * made with an exception pending ("WARNING in native method: JNI call made without checking
   * exceptions when required to").
   */
  static final Pattern JNI_COMPLAINT = Pattern.compile(
      "(WARNING|FATAL ERROR) in native method|WARNING: JNI local refs|"
          + "JNI call made without checking exceptions|"
          + "A fatal error has been detected by the Java Runtime Environment");

  /** @return the lines of {@code text} that are JNI complaints */
  static List<String> jniComplaints(String text) {
    List<String> out = new ArrayList<>();
    for (String line : text.split("\r?\n")) {
      if (JNI_COMPLAINT.matcher(line).find()) {
        out.add(line);
      }
    }
    return out;
  }

  /** Where the native library is, or null: bundled resource or java.library.path. */
  private static String findLibrary() {
    String os = NativeLoader.osName(System.getProperty("os.name"));
    String arch = NativeLoader.archName(System.getProperty("os.arch"));
    for (String variant : new String[] {NativeLoader.LIB_NAME,
        NativeLoader.LIB_NAME + NativeLoader.TCP_SUFFIX}) {
      String res = NativeLoader.resourcePath(os, arch, variant);
      if (NativeLoader.class.getResource(res) != null) {
        return "classpath:" + res;
      }
    }
    String libPath = System.getProperty("java.library.path", "");
    for (String d : libPath.split(File.pathSeparator)) {
      File f = new File(d, System.mapLibraryName(NativeLoader.LIB_NAME));
      if (!d.isEmpty() && f.isFile()) {
        return f.getAbsolutePath();
      }
    }
    return null;
  }

  @Test
  public void detectorRecognisesHotSpotComplaints() {
    // The exact shapes HotSpot 17 prints; if the detector missed them the real test could not fail.
    String sample = "step 3: batch\n"
        + "WARNING in native method: JNI call made without checking exceptions when required to"
        + " from CallVoidMethodA\n"
        + "\tat org.apache.spark.shuffle.rdma.NativeBridge.fetchBlocks(Native Method)\n"
        + "WARNING: JNI local refs: 33, exceeds capacity: 32\n"
        + "FATAL ERROR in native method: Bad global or local ref passed to JNI\n"
        + "JNI_SCENARIO_OK steps=14\n";
    List<String> found = jniComplaints(sample);
    assertEquals(found.toString(), 3, found.size());
    assertTrue(jniComplaints("step 1: load\n  loaded from java.library.path\n").isEmpty());
  }

  @Test
  public void bridgeRunsCleanUnderCheckJni() throws Exception {
    String lib = findLibrary();
    if (lib == null) {
      String why = "NativeBridgeJniTest SKIPPED: librdma_shuffle_jni.so is neither bundled in the"
          + " test classpath nor on java.library.path; build it with scripts/build-native.sh"
          + " (or run scripts/jni-test.sh)";
      if (Boolean.getBoolean("rdma.jni.required")) {
        fail(why.replace("SKIPPED", "FAILED (rdma.jni.required=true)"));
      }
      System.err.println(why);
      Assume.assumeTrue(why, false);
    }
    File out = outDir();
    File scratch = new File(out, "scratch");
    deleteTree(scratch);
    assertTrue("cannot create " + scratch, scratch.mkdirs());
    File stdout = new File(out, "child.stdout");
    File stderr = new File(out, "child.stderr");

    List<String> cmd = new ArrayList<>(Arrays.asList(
        new File(System.getProperty("java.home"), "bin/java").getPath(),
        "-Xcheck:jni",
        "-Xmx256m",
        "-cp", System.getProperty("java.class.path"),
        "-Djava.library.path=" + System.getProperty("java.library.path", ""),
        NativeBridgeJniScenario.class.getName(),
        scratch.getPath()));
    ProcessBuilder pb = new ProcessBuilder(cmd)
        .redirectOutput(stdout)
        .redirectError(stderr);
    // Native logs at info level are enough to see what the engine did; warnings stay visible.
    pb.environment().put("RUST_LOG", "info");
    long t0 = System.nanoTime();
    Process p = pb.start();
    boolean exited = p.waitFor(CHILD_TIMEOUT_S, TimeUnit.SECONDS);
    if (!exited) {
      p.destroyForcibly().waitFor(10, TimeUnit.SECONDS);
    }
    String so = new String(Files.readAllBytes(stdout.toPath()), StandardCharsets.UTF_8);
    String se = new String(Files.readAllBytes(stderr.toPath()), StandardCharsets.UTF_8);
    String both = "--- child stdout (" + stdout + ")\n" + tail(so) + "\n--- child stderr (" + stderr
        + ")\n" + tail(se);
    assertTrue("child JVM did not finish within " + CHILD_TIMEOUT_S + " s\n" + both, exited);
    List<String> complaints = jniComplaints(so);
    complaints.addAll(jniComplaints(se));
    assertTrue("-Xcheck:jni complaints:\n  " + String.join("\n  ", complaints) + "\n" + both,
        complaints.isEmpty());
    assertEquals("child JVM exit code\n" + both, 0, p.exitValue());
    assertTrue("the scenario did not report success\n" + both,
        so.contains(NativeBridgeJniScenario.OK_MARKER));
    System.out.printf("NativeBridgeJniTest: %s under -Xcheck:jni in %.1f s, library %s (logs %s)%n",
        so.substring(so.indexOf(NativeBridgeJniScenario.OK_MARKER)).trim(),
        (System.nanoTime() - t0) / 1e9, lib, out);
    deleteTree(scratch);
  }

  /** {@code <build dir>/jni-check}: next to the test classes, so each profile keeps its own. */
  private static File outDir() throws Exception {
    String prop = System.getProperty("rdma.jni.outDir");
    if (prop != null) {
      return new File(prop).getAbsoluteFile();
    }
    File testClasses = new File(NativeBridgeJniTest.class.getProtectionDomain().getCodeSource()
        .getLocation().toURI());
    return new File(testClasses.getParentFile(), "jni-check");
  }

  private static String tail(String s) {
    return s.length() <= 6000 ? s : "...\n" + s.substring(s.length() - 6000);
  }

  private static void deleteTree(File f) throws IOException {
    File[] kids = f.listFiles();
    if (kids != null) {
      for (File k : kids) {
        deleteTree(k);
      }
    }
    Files.deleteIfExists(f.toPath());
  }
}
