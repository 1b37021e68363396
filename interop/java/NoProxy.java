import java.net.Proxy;
import java.net.ProxySelector;
import java.net.URI;

/** Prints, for each host given, whether the JVM's default ProxySelector (configured by
 *  the system properties in JAVA_TOOL_OPTIONS) sends an http:// and an https:// request
 *  to it through a proxy ("P") or directly ("D"): {@code HOST P}. Run by tests/interop.rs. */
public class NoProxy {
    public static void main(String[] args) throws Exception {
        ProxySelector selector = ProxySelector.getDefault();
        for (String host : args) {
            String http = via(selector, URI.create("http://" + host + ":9/"));
            String https = via(selector, URI.create("https://" + host + ":9/"));
            System.out.println(host + " " + (http.equals(https) ? http : http + "/" + https));
        }
    }

    static String via(ProxySelector selector, URI uri) {
        Proxy first = selector.select(uri).get(0);
        return first.type() == Proxy.Type.DIRECT ? "D" : "P";
    }
}
